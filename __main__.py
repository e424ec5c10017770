"""`python -m qwen35_fast demo` and friends: see runtime/cli.py."""
import sys

from .runtime.cli import main

sys.exit(main())
