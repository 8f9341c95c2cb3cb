"""`python -m kestreld`: the daemon."""
import sys

from .main import main

sys.exit(main())
