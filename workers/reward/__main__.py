"""`python -m areal.workers.reward --connect tcp://HOST:PORT`: a reward worker."""

from areal.workers.base import worker_main
from areal.workers.reward.worker import RewardWorker

if __name__ == "__main__":
    worker_main(RewardWorker)
