"""The rule of ``tests/_cuda_rule.py``: a test that touches CUDA carries the ``cuda`` marker, and
collection fails when one does not. Each form of "touches CUDA" on a module written for it, the
forms that must not count, and a real ``pytest --collect-only`` over such modules (the exit
status and the message), with this suite's own hook."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from _cuda_rule import scan_module

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _why(source: str, name: str = "test_x", cls: str | None = None) -> list[str]:
    found = scan_module(textwrap.dedent(source)).test_findings(name, cls)
    assert found is not None, f"{name} not found"
    return [f.what for f in found]


@pytest.mark.parametrize(
    "body",
    [
        'torch.zeros(1, device="cuda")',
        'torch.device("cuda:1")',
        'x.to("cuda")',
        'init_device_mesh("cuda", (1,))',
        "x.cuda()",
        "torch.cuda.synchronize()",
        "torch.cuda._sleep(10)",
    ],
)
def test_asking_for_a_cuda_device_counts(body):
    assert _why(f"def test_x():\n    {body}\n")


@pytest.mark.parametrize(
    "body",
    [
        "torch.cuda.is_available()",
        "torch.cuda.device_count()",
        'torch.zeros(1, device="cpu")',
        "OptimizerConfig(cuda_graph=True)",
        'name = "cuda_graph"',
        'assert device == "cuda" or True',
        'if device == "cuda":\n        torch.cuda.synchronize()',
        "if torch.cuda.is_available():\n        x = x.cuda()\n    else:\n        x = x.cpu()",
        "x = x.cuda() if torch.cuda.is_available() else x",
    ],
)
def test_queries_names_and_conditional_paths_do_not(body):
    assert _why(f"def test_x(device, x):\n    {body}\n") == []


def test_skipping_without_cuda_counts_wherever_it_is_written():
    skipif = '@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")\n'
    assert _why(skipif + "def test_x():\n    pass\n")
    assert _why("def test_x():\n    if not torch.cuda.is_available():\n        pytest.skip('x')\n")
    assert _why(
        "HAS_CUDA = True\n"
        + skipif.replace("not torch.cuda.is_available()", "not HAS_CUDA")
        + "def test_x():\n    pass\n"
    )
    module = 'pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="x")]\n'
    assert _why(module + "def test_x():\n    pass\n")
    module_skip = (
        "if not torch.cuda.is_available():\n    pytest.skip('x', allow_module_level=True)\n"
    )
    assert _why(module_skip + "def test_x():\n    pass\n")
    klass = skipif + "class TestC:\n    def test_x(self):\n        pass\n"
    assert _why(klass, cls="TestC")
    # a skip for another reason, and a parametrize whose CUDA case is its own (rule 3)
    assert (
        _why('@pytest.mark.skipif(not HAVE_APEX, reason="apex")\ndef test_x():\n    pass\n') == []
    )
    assert (
        _why(
            '@pytest.mark.parametrize("d", ["cpu", pytest.param("cuda", marks=m)])\n'
            "def test_x(d):\n    pass\n"
        )
        == []
    )


def test_the_helpers_a_test_names_are_read_too():
    source = """
        def _on_gpu():
            return torch.ones(1).cuda()

        def _rank_fn():
            return _on_gpu()

        def _cpu_only():
            return torch.ones(1)

        def test_x(ranks):
            ranks(2).run(_rank_fn)

        def test_y():
            _cpu_only()
        """
    assert _why(source) == ["calls .cuda()"]  # through _rank_fn, passed on, then _on_gpu
    assert _why(source, "test_y") == []


def _collect(tmp_path, files: dict[str, str]) -> subprocess.CompletedProcess:
    """``pytest --collect-only`` over ``files`` in ``tmp_path``, with this suite's hook."""
    conftest = (
        f"import sys\nsys.path.insert(0, {TESTS!r})\n"
        "from _cuda_rule import require_cuda_marker\n\n\n"
        "def pytest_collection_modifyitems(items):\n    require_cuda_marker(items)\n"
    )
    (tmp_path / "conftest.py").write_text(conftest)
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    ini = "[pytest]\nmarkers =\n    cuda: needs a CUDA device\n"
    (tmp_path / "pytest.ini").write_text(ini)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_collection_fails_on_an_unmarked_cuda_test(tmp_path):
    proc = _collect(
        tmp_path,
        {
            "test_a.py": """
                import pytest
                import torch

                @pytest.mark.parametrize("device", ["cpu", "cuda"])
                def test_devices(device):
                    torch.zeros(1, device=device)

                @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
                def test_skipped_instead_of_marked():
                    pass

                def test_plain():
                    torch.zeros(1)
                """
        },
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "2 test(s) touch CUDA without the `cuda` marker" in out, out
    assert "test_a.py::test_devices[cuda]: its parameter device='cuda' is a CUDA device" in out
    assert "test_a.py::test_skipped_instead_of_marked: line 9: skips without CUDA" in out, out
    assert "test_devices[cpu]" not in out.split("marker")[1] and "test_plain:" not in out


def test_collection_passes_once_they_are_marked(tmp_path):
    proc = _collect(
        tmp_path,
        {
            "test_a.py": """
                import pytest
                import torch

                CUDA = pytest.param("cuda", marks=pytest.mark.cuda)

                @pytest.mark.parametrize("device", ["cpu", CUDA])
                def test_devices(device):
                    torch.zeros(1, device=device)

                @pytest.mark.cuda
                def test_marked():
                    torch.cuda.synchronize()
                """,
            "test_b.py": """
                import pytest
                import torch

                pytestmark = pytest.mark.cuda

                def test_module_marked():
                    torch.ones(1).cuda()
                """,
        },
    )
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout + proc.stderr
    assert "4 tests collected" in proc.stdout, proc.stdout
