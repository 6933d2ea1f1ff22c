"""Tests of the sagebwd wheel that need neither a GPU nor PyTorch: the extension loads, the
configuration and argument checks accept what they should and refuse the rest with clear errors,
and asking for the GPU without one fails with an error that says why.

Run: python -m unittest test_no_gpu (scripts/test_python.sh runs it in a fresh venv). Environment:
SAGEBWD_TEST_NVRTC_DIR, a directory holding libnvrtc.so.13 (enables the test that NVRTC is found
there and the driver's absence is what is reported)."""

import os
import subprocess
import sys
import unittest

import sagebwd
from sagebwd import _validate

BF, F16 = "bfloat16", "float16"
CUDA0 = ("cuda", 0)


def check(q, k, v=None, dtypes=(BF, BF, BF), devices=(CUDA0, CUDA0, CUDA0), causal=False, scale=None, layout="bhnd"):
    return _validate.check(q, k, k if v is None else v, dtypes, devices, causal=causal, scale=scale, layout=layout)


class Package(unittest.TestCase):
    def test_constants(self):
        self.assertEqual(sagebwd.HEAD_DIMS, (64, 128))
        self.assertEqual(sagebwd.PRODUCTS, ("qk", "pv", "qk-bwd", "dv", "dp", "dq", "dk"))
        self.assertIn("sagebwd", sagebwd.PRESETS)

    def test_cache_dir_follows_env(self):
        code = "import sagebwd; print(sagebwd.cache_dir())"
        env = dict(os.environ, SAGEBWD_CACHE_DIR="/tmp/sagebwd-cache-test")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.strip(), "/tmp/sagebwd-cache-test")

    def test_attention_without_torch(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            with self.assertRaisesRegex(ImportError, "PyTorch"):
                sagebwd.attention(None, None, None)
        else:
            self.skipTest("torch is installed")


    def test_backward_memory_policy(self):
        for ok in ("lean", "auto", "off", "3"):
            sagebwd.set_backward_memory(ok)
        for bad in ("fast", "0", "-1", ""):
            with self.assertRaisesRegex(ValueError, "backward memory policy"):
                sagebwd.set_backward_memory(bad)
        sagebwd.set_backward_memory("lean")
        sagebwd.empty_cache()  # no device opened: nothing to release, no error


class Configs(unittest.TestCase):
    def test_presets(self):
        self.assertEqual(sagebwd.Config("sagebwd").int8, ["qk", "pv", "qk-bwd", "dv", "dq", "dk"])
        self.assertEqual(sagebwd.Config("fpa").int8, [])
        self.assertEqual(len(sagebwd.Config("int8-all").int8), 7)
        self.assertTrue(sagebwd.Config("sagebwd").smooth_k)

    def test_switches(self):
        c = sagebwd.Config("sagebwd", int8=["dp"])
        self.assertEqual(len(c.int8), 7)
        c = sagebwd.Config("fpa", int8=["dq"], smooth_k=False)
        self.assertEqual((c.int8, c.smooth_k), (["dq"], False))
        c = sagebwd.Config("sagebwd", bf16=["pv", "qk"])
        self.assertNotIn("pv", c.int8)
        self.assertNotIn("qk", c.int8)

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "unknown preset"):
            sagebwd.Config("int4")
        with self.assertRaisesRegex(ValueError, "unknown product `dz`"):
            sagebwd.Config("sagebwd", int8=["dz"])
        with self.assertRaisesRegex(ValueError, "both int8 and bf16"):
            sagebwd.Config("fpa", int8=["dq"], bf16=["dq"])


class Arguments(unittest.TestCase):
    def test_accepts(self):
        self.assertEqual(check((2, 8, 100, 128), (2, 2, 300, 128)), (2, 8, 2, 100, 300, 128))
        self.assertEqual(check((2, 100, 8, 64), (2, 300, 4, 64), layout="bnhd"), (2, 8, 4, 100, 300, 64))
        self.assertEqual(check((1, 1, 1, 64), (1, 1, 1, 64), dtypes=(F16, F16, F16), causal=True)[3], 1)

    def test_layout_and_rank(self):
        with self.assertRaisesRegex(ValueError, "layout"):
            check((1, 1, 8, 64), (1, 1, 8, 64), layout="nhd")
        with self.assertRaisesRegex(ValueError, "4-D"):
            check((1, 8, 64), (1, 1, 8, 64))

    def test_dtypes_devices(self):
        with self.assertRaisesRegex(TypeError, "float32"):
            check((1, 1, 8, 64), (1, 1, 8, 64), dtypes=("float32",) * 3)
        with self.assertRaisesRegex(TypeError, "one dtype"):
            check((1, 1, 8, 64), (1, 1, 8, 64), dtypes=(BF, F16, BF))
        with self.assertRaisesRegex(ValueError, "CUDA"):
            check((1, 1, 8, 64), (1, 1, 8, 64), devices=(("cpu", None),) * 3)
        with self.assertRaisesRegex(ValueError, "one device"):
            check((1, 1, 8, 64), (1, 1, 8, 64), devices=(CUDA0, ("cuda", 1), CUDA0))

    def test_shapes(self):
        with self.assertRaisesRegex(ValueError, "d = 64 and 128"):
            check((1, 1, 8, 96), (1, 1, 8, 96))
        with self.assertRaisesRegex(ValueError, "multiple of key/value heads"):
            check((1, 6, 8, 64), (1, 4, 8, 64))
        with self.assertRaisesRegex(ValueError, "one shape"):
            check((1, 2, 8, 64), (1, 2, 8, 64), v=(1, 2, 9, 64))
        with self.assertRaisesRegex(ValueError, "batch"):
            check((2, 2, 8, 64), (1, 2, 8, 64))
        with self.assertRaisesRegex(ValueError, "head dimension"):
            check((1, 2, 8, 64), (1, 2, 8, 128))
        with self.assertRaisesRegex(ValueError, "empty"):
            check((1, 2, 0, 64), (1, 2, 8, 64))
        with self.assertRaisesRegex(ValueError, "grid limit"):
            check((1024, 128, 8, 64), (1024, 128, 8, 64))

    def test_causal_scale(self):
        with self.assertRaisesRegex(TypeError, "causal"):
            check((1, 1, 8, 64), (1, 1, 8, 64), causal=1)
        with self.assertRaisesRegex(ValueError, "positive"):
            check((1, 1, 8, 64), (1, 1, 8, 64), scale=-0.1)
        with self.assertRaisesRegex(TypeError, "scale"):
            check((1, 1, 8, 64), (1, 1, 8, 64), scale="0.1")
        self.assertIsNone(_validate.q_factor(None, 128))
        self.assertIsNone(_validate.q_factor(128 ** -0.5, 128))
        self.assertAlmostEqual(_validate.q_factor(0.25, 64), 2.0)

    def test_products(self):
        self.assertEqual(_validate.products(None, "int8"), [])
        self.assertEqual(_validate.products("dq", "int8"), ["dq"])
        with self.assertRaisesRegex(TypeError, "int8"):
            _validate.products([3], "int8")


def run_isolated(code, **env):
    full = dict(os.environ, **env)
    for k in ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "SAGEBWD_NVRTC_DIR"):
        if k not in env:
            full.pop(k, None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)


REPORT = """
import sagebwd
try:
    sagebwd.device_info()
except RuntimeError as e:
    print("RuntimeError:", e)
else:
    print("no error")
"""


class NoGpu(unittest.TestCase):
    def test_missing_nvrtc_is_named(self):
        if sagebwd.find_nvrtc() is not None and "SAGEBWD_NVRTC_DIR" not in os.environ:
            self.skipTest("an NVRTC is installed where the package looks")
        if run_isolated("import ctypes; ctypes.CDLL('libnvrtc.so.13')").returncode == 0:
            self.skipTest("libnvrtc.so.13 is on the system library path")
        out = run_isolated(REPORT)
        self.assertIn("RuntimeError:", out.stdout, out.stderr)
        self.assertIn("libnvrtc.so.13", out.stdout)
        self.assertIn("nvidia-cuda-nvrtc", out.stdout)

    def test_missing_driver_is_named(self):
        nvrtc_dir = os.environ.get("SAGEBWD_TEST_NVRTC_DIR")
        if not nvrtc_dir:
            self.skipTest("SAGEBWD_TEST_NVRTC_DIR not set")
        out = run_isolated(REPORT, SAGEBWD_NVRTC_DIR=nvrtc_dir)
        self.assertIn("RuntimeError:", out.stdout, out.stderr)
        # This machine has no GPU: the driver (or, with a driver, the GPU) is what is missing.
        self.assertRegex(out.stdout, "CUDA driver not found|no CUDA GPU|device count")


if __name__ == "__main__":
    unittest.main()
