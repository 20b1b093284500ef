"""``python -m fastgen.bench``: the serving benchmark (see fastgen/bench/cli.py)."""
import sys

from .cli import main

sys.exit(main())
