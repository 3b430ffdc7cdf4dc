"""`python -m areal.workers.trainer --connect tcp://HOST:PORT [--rank R]`: a trainer worker."""

from areal.workers.base import worker_main
from areal.workers.trainer.worker import TrainerWorker

if __name__ == "__main__":
    worker_main(TrainerWorker)
