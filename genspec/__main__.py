import sys

from genspec.cli import main

sys.exit(main())
