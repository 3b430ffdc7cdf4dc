"""`python -m areal.workers.rollout --connect tcp://HOST:PORT`: a rollout worker."""

from areal.workers.base import worker_main
from areal.workers.rollout.worker import RolloutWorker

if __name__ == "__main__":
    worker_main(RolloutWorker)
