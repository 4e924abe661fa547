# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""`python -m meshkit`: the `meshkit` command (what meshkit watch's schedules run, by the interpreter's path)."""

import sys

from meshkit.cli import main

sys.exit(main())
