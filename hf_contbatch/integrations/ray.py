"""``hf_contbatch.frontends.integrations.ray`` under the integrations' import path."""

import sys

from ..frontends.integrations import ray as _module

sys.modules[__name__] = _module
