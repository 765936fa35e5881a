"""rtxmpi.backend.tune_host_allocator: numpy's large temporaries stay in the process."""
import json
import os
import subprocess
import sys

import pytest

from rtxmpi import backend

# a fresh process (mallopt is process-wide) runs three "steps", each writing and then freeing 40
# arrays of 0.5-3 MiB (about 70 MiB, like a layer stack's temporaries: numpy asks the kernel for
# huge pages only from 4 MiB); the minor page faults of the last step
PROBE = """
import json, resource, sys
import numpy as np
from rtxmpi.backend import tune_host_allocator
tuned = tune_host_allocator() if sys.argv[1] == "tune" else False
for step in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.full((1 + i % 6) << 17, 1.0, np.float32) for i in range(40)]
    del arrays
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


def probe(mode):
    env = {k: v for k, v in os.environ.items()
           if k not in backend._USER_MALLOC_SETTINGS + ("RTXMPI_HOST_MALLOC", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout)


@pytest.mark.skipif(not (hasattr(os, "confstr") and "CS_GNU_LIBC_VERSION" in os.confstr_names),
                    reason="mallopt is glibc's")
def test_a_step_s_temporaries_are_reused_without_page_faults():
    tuned, plain = probe("tune"), probe("plain")
    assert tuned["tuned"] is True
    if plain["faults"] < 1000:  # this kernel maps the array in huge pages anyway
        pytest.skip(f"untuned allocation took only {plain['faults']} faults")
    assert tuned["faults"] < plain["faults"] / 10, (tuned, plain)


def test_the_user_s_own_malloc_settings_and_the_off_switch_are_respected():
    for environ in ({"RTXMPI_HOST_MALLOC": "0"}, {"RTXMPI_HOST_MALLOC": "off"},
                    {"RTXMPI_HOST_MALLOC": "False"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                    {"MALLOC_TRIM_THRESHOLD_": "0"}, {"MALLOC_TOP_PAD_": "0"},
                    {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}):
        assert backend.tune_host_allocator(environ) is False, environ
