import sys

from kvstorm.cli import main

sys.exit(main())
