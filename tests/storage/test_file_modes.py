"""Files written atomically and directories published whole get the modes a plain open() / os.mkdir would
give them (0o666 / 0o777 less the umask), not tempfile's owner-only 0o600 / 0o700."""
import os
import stat

import pytest

from glm5_jax import storage
from glm5_jax.convert.atomic_dir import atomic_output_dir


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_writes_respect_the_umask(tmp_path, umask):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    storage.write_atomically(str(tmp_path / "config.json"), b"{}")
    storage.copy_file(str(plain), str(tmp_path / "copy.txt"))
    with storage.open_for_write(str(tmp_path / "opened.bin")) as f:
        f.write(b"x")
    for name in ("config.json", "copy.txt", "opened.bin"):
        assert _mode(tmp_path / name) == 0o666 & ~umask == _mode(plain), name


def test_published_directory_respects_the_umask(tmp_path, umask):
    out = tmp_path / "out"
    with atomic_output_dir(str(out), overwrite=False) as tmp:
        storage.write_atomically(storage.join(tmp, "config.json"), b"{}")
    (tmp_path / "plain").mkdir()
    assert _mode(out) == 0o777 & ~umask == _mode(tmp_path / "plain")
    assert _mode(out / "config.json") == 0o666 & ~umask
    assert sorted(os.listdir(tmp_path)) == ["out", "plain"]
