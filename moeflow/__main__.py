"""`python -m moeflow ...` (what torchrun -m moeflow runs)."""

from .cli import main

raise SystemExit(main())
