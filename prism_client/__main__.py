"""`python -m prism_client decide|determinism-check|health ...`: the client's commands alone."""
import sys

from .cli import main

sys.exit(main())
