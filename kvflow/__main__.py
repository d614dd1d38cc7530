import sys

from kvflow.cli import main

sys.exit(main())
