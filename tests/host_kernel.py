"""The host Adam kernel in tests: where it cannot match torch's arithmetic on this CPU (the product then
steps with torch's kernel, as it should), the tests of the kernel's own paths skip, naming the reason;
any other reason it did not load (no compiler aside) fails them."""

from __future__ import annotations

import shutil

import pytest


def require():
    from lightning_zeroq.ops import host_adam as H

    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the host kernel")
    kernel = H.host_adam()
    if kernel is None and H.unavailable_reason() == H.NO_MATCH:
        pytest.skip(f"the host kernel: {H.NO_MATCH}")
    assert kernel is not None, f"the host kernel did not load: {H.unavailable_reason()}"
    return kernel
