"""encoders: towers, projectors and their registries for vision, audio and graphs.

Meets the runner's encoder protocol structurally and never imports `runner` or `bridge`.
"""

from encoders.api import *  # noqa: F401,F403
from encoders.api import __all__  # noqa: F401
