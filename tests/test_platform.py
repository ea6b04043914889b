"""The per-OS fix of SPEC §10 runs before the first `import torch` in every process gbray starts."""

import subprocess
import sys

import pytest

import gbray

# Run in a fresh interpreter: a finder placed first in sys.meta_path sees torch's import and
# records whether the fix had run by then.
PROBE = """
import importlib, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            platform = sys.modules.get("gbray.platform")
            seen.append(bool(platform and platform.TORCH_IMPORT_PREPARED))
        return None
sys.meta_path.insert(0, Watch())
importlib.import_module(sys.argv[1])
print(repr(seen))
"""


def gbray_modules() -> list[str]:
    import pkgutil

    return sorted(m.name for m in pkgutil.walk_packages(gbray.__path__, "gbray."))


def test_every_module_is_listed():
    names = gbray_modules()
    assert {"gbray.trainer", "gbray.examiner", "gbray.actors", "gbray.round"} <= set(names)


@pytest.mark.parametrize("module", gbray_modules())
def test_no_module_imports_torch_before_the_platform_fix(module):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = eval(out.stdout.strip().splitlines()[-1])
    assert all(seen), f"{module} imported torch before prepare_torch_import ran"
    if module in ("gbray.trainer", "gbray.examiner", "gbray.model"):
        assert seen, f"{module} should import torch (the probe saw nothing)"


def test_the_driver_and_the_hub_stay_light():
    """The driver holds typed results, not models: importing the round, the command line and the
    hub's server loads no torch (it loads in the actors)."""
    probe = "import sys, gbray.cli, gbray.round, gbray.hub.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
