"""Developer sessions: nox -s tests | lint | typecheck | demo | bench | docs | gpu | floor."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
TORCH = "torch==2.13.0"  # the CPU build; the package itself accepts a range


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def floor(session: nox.Session) -> None:
    """The whole suite on the CPU with the oldest torch the package accepts (2.11: its PyPI
    wheel is a CUDA build, about 5 GB with its CUDA libraries, which runs on the CPU too), the
    demo and the docs' pages included. Not in CI."""
    session.install("torch==2.11.0")
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "tests", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "examples", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(TORCH, "mypy==2.4.1")
    session.install("-e", ".")
    session.run("mypy", "src")


@nox.session
def demo(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[demo]")
    session.run("python", "examples/demo.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".")
    for script in ("bench_stats.py", "bench_step.py", "bench_checkpoint.py"):
        session.run("python", f"benchmarks/{script}", *session.posargs)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """The whole suite (the CUDA tests and every other) and a short smoke run of each GPU
    benchmark (``scripts/gpu_check.sh``; ``nox -s gpu -- tests`` or ``-- bench`` for one part),
    with the python3 of the machine (torch with CUDA, triton, pytest, hypothesis and
    pytest-timeout installed, or their wheels in .whl/; the package from src/). Logs under $OUT
    or gpu_out/."""
    session.run("bash", "scripts/gpu_check.sh", *session.posargs, external=True)


@nox.session
def docs(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")


@nox.session
def conformance(session: nox.Session) -> None:
    """Every third-party class of the `thirdparty` extra under the wrapper on three layouts
    (scripts/conformance.py --kinds): rewrites docs/conformance.json and the table in
    docs/optimizers.md, then checks every row (tests/optim/test_conformance.py)."""
    session.install(TORCH)
    session.install("-e", ".[test,thirdparty]")
    session.run("python", "scripts/conformance.py", "--kinds")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/optim/test_conformance.py",
        "-q",
        env={"MFSDP_CONFORMANCE": "1"},
    )
