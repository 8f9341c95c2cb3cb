"""`python -m kestreld`: the daemon."""
import sys

from .service.main import main

sys.exit(main())
