import sys

from mini.cli import main

sys.exit(main())
