import sys

from meshplan.main import main

sys.exit(main())
