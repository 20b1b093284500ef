"""``python -m fastgen.parallel.worker``: one non-zero rank of a tensor-parallel replica, as rank
0 starts it on this machine (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set;
``FASTGEN_TP_DEVICE`` names the device type). Under torchrun, ``fastgen serve`` runs the same
loop on every rank but 0."""
from __future__ import annotations

import logging
import os
import sys

import torch


def main() -> int:
    logging.basicConfig(level=logging.INFO, format=f"fastgen rank {os.environ.get('RANK', '?')}: %(message)s")
    from .replica import serve_rank

    return serve_rank(torch.device(os.environ.get("FASTGEN_TP_DEVICE", "cpu")))


if __name__ == "__main__":
    sys.exit(main())
