"""``python -m fastgen.kernels``: build the native CPU kernels for this host now (``make setup`` does)."""
import logging
import sys

from . import load

logging.basicConfig(level=logging.INFO, format="%(message)s")
ok = load()
print("fastgen native CPU kernels:", "ready" if ok else "unavailable (the PyTorch path will be used)")
sys.exit(0)
