import sys

from ftctl.cli import main

sys.exit(main())
