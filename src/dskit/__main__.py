import sys

from dskit.cli import main

sys.exit(main())
