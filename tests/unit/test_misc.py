import pytest
import torch

from timeshare.device import resolve_device
from timeshare.errors import ConfigError, DeviceError
from timeshare.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "value,expected",
    [(4096, 4096), ("4GiB", 4 << 30), ("512MB", 512_000_000), ("1.5 KiB", 1536), ("100", 100), ("2mib", 2 << 20)],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["4 parsecs", "", "-1", 0, -5, True, 3.5, "GiB"])
def test_parse_bytes_rejects(value):
    with pytest.raises(ConfigError, match="memory"):
        parse_bytes(value, what="memory")


def test_format_bytes():
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(10) == "10 B"


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    with pytest.raises(ConfigError, match="device must be one of"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="device must be one of .* got 3$"):
        resolve_device(3)
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(DeviceError, match="CUDA is not available"):
            resolve_device("cuda")


def test_import_does_not_initialize_cuda():
    import subprocess
    import sys

    code = "import timeshare, torch; assert not torch.cuda.is_initialized(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
