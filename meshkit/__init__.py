# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshkit's controller side: the ``meshkit`` command, the job launcher and planner, inventory
validation and the local lab. The hosts run only the meshkit.cluster collection's modules (and
the launch agent it ships); this package runs where ansible-playbook runs."""
