"""llama.cpp's own C++ server, ``llama-server``, as a baseline: built once from the llama.cpp source that
llama-cpp-python's sdist vendors (the same commit as the bindings genspec runs), started on loopback.

It is what a CPU user serving a GGUF file would otherwise run: parallel slots batched in one
``llama_decode`` per step, prompts chunked into the same batch as running slots, and model-free
speculation (:data:`SPEC_TYPES`). :func:`server_binary` finds or builds it; :class:`LlamaServer` runs one.

The build (``cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF``, static, target ``llama-server``) goes to
``<cache_root>/llama-server/<llama-cpp-python version>/``; ``$CMAKE_ARGS`` is passed on, so the flags a
user gave pip for the bindings apply to the server too. ``$GENSPEC_LLAMA_SERVER`` names a binary to use
instead. The sdist comes from PyPI (verified against its published SHA-256), the only network access, and
only when nothing is cached.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from genspec.errors import ConfigError, InputFileError

#: llama-server's model-free ``--spec-type`` values, ``none`` (plain decoding) and ``default``: its
#: ``--spec-default`` (``ngram-mod`` with its recommended match and draft lengths). The draft-model types
#: need a draft GGUF (``-md``)
SPEC_TYPES = ("none", "default", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def bindings_version() -> str:
    """The installed llama-cpp-python's version: the sdist whose vendored llama.cpp is built."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ConfigError("llama-server is built from llama-cpp-python's source: install genspec[llamacpp]") from exc
    return llama_cpp.__version__


def build_dir(version: str | None = None) -> Path:
    from genspec.embedded import cache_root

    return cache_root() / "llama-server" / (version or bindings_version())


def server_binary(progress: bool = True) -> Path:
    """The ``llama-server`` executable: ``$GENSPEC_LLAMA_SERVER``, else the cached build, else built now
    (several minutes; the time is printed on stderr)."""
    named = os.environ.get("GENSPEC_LLAMA_SERVER")
    if named:
        if not Path(named).is_file():
            raise InputFileError(f"$GENSPEC_LLAMA_SERVER names {named}, which is not a file")
        return Path(named)
    binary = build_dir() / "bin" / "llama-server"
    if binary.is_file():
        return binary
    return build(progress=progress)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def download_sdist(version: str, target: Path, progress: bool = True) -> Path:
    """llama-cpp-python's sdist of ``version`` from PyPI, checked against the SHA-256 PyPI publishes."""
    # PyPI's simple index as JSON (PEP 691): every file of the project with its SHA-256
    request = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    name = f"llama_cpp_python-{version}.tar.gz"
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            sdist = next(f for f in json.load(response)["files"] if f["filename"] == name)
        _say(progress, f"llama-server: downloading {name} ({sdist.get('size', 0) / 1e6:.0f} MB)")
        digest = hashlib.sha256()
        with urllib.request.urlopen(sdist["url"], timeout=600) as response, open(target, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (OSError, StopIteration, KeyError, ValueError) as exc:
        raise InputFileError(f"cannot download llama-cpp-python {version}'s source from PyPI to build "
                             f"llama-server ({exc}); set $GENSPEC_LLAMA_SERVER to a built binary") from exc
    if digest.hexdigest() != sdist["hashes"]["sha256"]:
        raise InputFileError(f"llama-cpp-python {version}'s sdist does not match PyPI's SHA-256")
    return target


def cmake_flags() -> list[str]:
    """What the build is configured with: a static server for this CPU, without curl, and ``$CMAKE_ARGS``."""
    return ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release", *shlex.split(os.environ.get("CMAKE_ARGS", ""))]


def build(progress: bool = True, jobs: int | None = None) -> Path:
    """Download, configure and build ``llama-server`` into :func:`build_dir`; returns the binary."""
    if shutil.which("cmake") is None:
        raise ConfigError("building llama-server needs cmake on the PATH")
    version = bindings_version()
    target = build_dir(version)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        work = Path(work)
        sdist = download_sdist(version, work / "sdist.tar.gz", progress)
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix):]
            archive.extractall(work / "src", members=[m for m in members if m.name], filter="data")
        _say(progress, f"llama-server: building llama.cpp (vendored by llama-cpp-python {version}); "
                       "several minutes")
        log = work / "build.log"
        with open(log, "w") as out:
            for command in (["cmake", "-S", str(work / "src"), "-B", str(work / "build"), *cmake_flags()],
                            ["cmake", "--build", str(work / "build"), "-j", str(jobs or os.cpu_count() or 1),
                             "--target", "llama-server"]):
                if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode != 0:
                    tail = log.read_text(errors="replace").splitlines()[-15:]
                    raise ConfigError("building llama-server failed:\n" + "\n".join(tail))
        (work / "out" / "bin").mkdir(parents=True)
        shutil.copy2(work / "build" / "bin" / "llama-server", work / "out" / "bin" / "llama-server")
        (work / "out" / "build.json").write_text(json.dumps(
            {"llama_cpp_python": version, "cmake_flags": cmake_flags(),
             "build_s": round(time.perf_counter() - started, 1)}, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(work / "out", target)
    _say(progress, f"llama-server: built in {time.perf_counter() - started:.0f} s -> {target / 'bin'}")
    return target / "bin" / "llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speculation_flags(spec_type: str) -> list[str]:
    """llama-server's command-line flags for one :data:`SPEC_TYPES` value (each type's own draft lengths are
    its defaults; ``extra`` flags of :class:`LlamaServer` change them, e.g. ``--spec-ngram-mod-n-max 16``)."""
    return {"none": [], "default": ["--spec-default"]}.get(spec_type, ["--spec-type", spec_type])


def server_command(model: Path, port: int, spec_type: str = "none", parallel: int = 1, context: int = 4096,
                   threads: int | None = None, extra: tuple[str, ...] = (), binary: Path | None = None) -> list[str]:
    """llama-server's command line on loopback: ``parallel`` slots of ``context`` tokens each, ``threads`` for
    both ``-t`` and ``-tb`` (default: every core this process may use), one :data:`SPEC_TYPES` value."""
    threads = threads or len(os.sched_getaffinity(0))
    return [str(binary or server_binary()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(context * parallel),
            "--no-webui", *speculation_flags(spec_type), *extra]


class LlamaServer:
    """One ``llama-server`` process on loopback, started on entering and stopped on leaving.

    ``spec_type`` is one of :data:`SPEC_TYPES`; ``parallel`` its slots (``-np``); ``context`` the whole
    KV cache, which llama-server splits evenly between the slots (``-c``); ``threads`` both ``-t`` and
    ``-tb``. ``extra`` is appended to the command line.
    """

    def __init__(self, model: Path, spec_type: str = "none", parallel: int = 1, context: int = 4096,
                 threads: int | None = None, extra: tuple[str, ...] = (), binary: Path | None = None):
        if spec_type not in SPEC_TYPES:
            raise ConfigError(f"unknown llama-server speculation {spec_type!r}; choose from {', '.join(SPEC_TYPES)}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(model, self.port, spec_type, parallel, context, threads, extra, binary)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        # its log goes to a file: a pipe nobody reads would stall the server once full
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        atexit.register(self.__exit__)  # a run that ends without leaving the block still stops its server
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise ConfigError(f"llama-server exited: {self.log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise ConfigError("llama-server did not become healthy in 5 minutes")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def complete(self, prompt: list[int] | str, max_tokens: int, sampling: dict | None = None) -> dict:
        """One non-streamed ``/completion`` (llama-server's native endpoint, which takes token ids and returns
        them); the response as JSON, with the request's wall time as ``wall_time_s``."""
        body = {"prompt": prompt, "n_predict": max_tokens, "cache_prompt": False, "return_tokens": True,
                "stream": False, **(sampling or {})}
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            out = json.load(response)
        out["wall_time_s"] = time.perf_counter() - started
        return out
