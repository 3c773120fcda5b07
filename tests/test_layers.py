"""The layers: the cost model is pure Python, below the runtime it models."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["partrain.predict", "partrain.recommend", "partrain.config",
                                    "partrain.predict.cluster", "partrain.validate", "partrain.validate_nodes",
                                    "partrain.validate_recommend"])
def test_the_cost_model_loads_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
