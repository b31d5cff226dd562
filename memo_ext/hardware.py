"""GPU profiles: memo_ext/hardware.json (device memory, peaks, bandwidths, the SM count and
compute capability the CUDA allocation rules need, the cost model's efficiency factors), read
by the estimator (memo_ext.estimate), the tracer's CUDA rules (memo_ext.trace.cuda_rules) and
the trainer's MFU peak (megatron/training/metrics.py). The file's ``_comment`` says what each
key means and where it comes from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

HARDWARE_FILE = Path(__file__).with_name("hardware.json")


class HardwareProfileError(ValueError):
    """A GPU profile that cannot be had; one line naming the input at fault and the fix."""


def load_hardware(name: str, extra_file: Optional[Path] = None) -> dict:
    """A GPU profile from hardware.json (or ``extra_file``, same keys, which wins), with the
    cost model's default ``efficiency`` table unless the profile has its own."""
    profiles = json.loads(HARDWARE_FILE.read_text())
    if extra_file is not None:
        try:
            profiles.update(json.loads(Path(extra_file).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise HardwareProfileError(f"--hardware-file {extra_file}: not a readable JSON file "
                                       f"of GPU profiles ({exc.__class__.__name__})") from None
    profiles.pop("_comment", None)
    efficiency = profiles.pop("efficiency")
    key = name.lower()
    if key not in profiles:
        raise HardwareProfileError(f"--gpu {name}: unknown; use one of "
                                   f"{', '.join(sorted(profiles))} or add it with --hardware-file")
    return {"name": key, "hardware_file": None if extra_file is None else str(extra_file),
            "efficiency": efficiency, **profiles[key]}


def profile_for_device(device_name: str) -> Optional[dict]:
    """The hardware.json profile (as :func:`load_hardware` gives it) of the first profile one of
    whose ``device_names`` patterns is found in ``device_name`` (torch.cuda.get_device_name()),
    or None when none is."""
    for key, profile in json.loads(HARDWARE_FILE.read_text()).items():
        patterns = profile.get("device_names", ()) if isinstance(profile, dict) else ()
        if any(re.search(pattern, device_name) for pattern in patterns):
            return load_hardware(key)
    return None


__all__ = ["HARDWARE_FILE", "HardwareProfileError", "load_hardware", "profile_for_device"]
