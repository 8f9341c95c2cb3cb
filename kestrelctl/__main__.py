"""`python -m kestrelctl`: the command-line client."""
import sys

from .cli import main

sys.exit(main())
