"""``python -m fastgen.bench``: the serving benchmark (see fastgen/bench/cli.py)."""
import sys

from ..launcher import reexec_with_allocator
from .cli import main

reexec_with_allocator([sys.executable, "-m", "fastgen.bench", *sys.argv[1:]])   # as `fastgen bench` does
sys.exit(main())
