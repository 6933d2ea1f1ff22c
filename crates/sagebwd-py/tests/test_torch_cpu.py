"""Tests of the PyTorch layer that need PyTorch but no GPU: the ops are registered with the
expected schemas, the wrapper's errors reach the user as ValueError/TypeError on real tensors, and
the fake (meta) implementations give the right shapes, so torch.compile can trace the op.

Run: python -m unittest test_torch_cpu (skipped as a whole without torch); scripts/test_python.sh runs it in
CI in a venv with torch 2.11.0. The fake-tensor test also checks that fake tensors take the custom op, not the
native eager path (which needs a GPU)."""

import unittest

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

import sagebwd


@unittest.skipIf(torch is None, "torch not installed")
class TorchLayer(unittest.TestCase):
    def test_ops_registered(self):
        fwd = str(torch.ops.sagebwd.attention_forward.default._schema)
        bwd = str(torch.ops.sagebwd.attention_backward.default._schema)
        self.assertIn("bool causal, str preset, str int8, str bf16, bool? smooth_k", fwd)
        self.assertIn("-> (Tensor, Tensor)", fwd)
        self.assertIn("-> (Tensor, Tensor, Tensor)", bwd)

    def test_errors_on_tensors(self):
        q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
        with self.assertRaisesRegex(ValueError, "CUDA"):
            sagebwd.attention(q, q, q)
        with self.assertRaisesRegex(TypeError, "float32"):
            sagebwd.attention(q.float(), q.float(), q.float())
        with self.assertRaisesRegex(ValueError, "layout"):
            sagebwd.attention(q, q, q, layout="nhd")

    def test_wrapper_on_fake_cuda_tensors(self):
        """FakeTensorMode makes CUDA tensors without a GPU: the wrapper's checks, conversions and the
        op's fake implementation run; dynamo traces the whole call as one graph."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        def f(q, k, v):
            return sagebwd.attention(q, k, v, causal=True, layout="bnhd", int8=["dp"])

        with FakeTensorMode():
            q = torch.empty(2, 100, 8, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            k = torch.empty(2, 300, 2, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            o = f(q, k, k)
            self.assertEqual((tuple(o.shape), o.dtype, o.requires_grad), ((2, 100, 8, 128), torch.bfloat16, True))
            q16, k16 = q.detach().half(), k.detach().half()
            self.assertEqual(sagebwd.attention(q16, k16, k16, scale=0.3, layout="bnhd").dtype, torch.float16)
            z = torch.empty(1, 2, 8, 80, dtype=torch.bfloat16, device="cuda")
            with self.assertRaisesRegex(ValueError, "d = 64 and 128"):
                sagebwd.attention(z, z, z)
            explained = torch._dynamo.explain(f)(q, k, k)
            self.assertEqual((explained.graph_count, explained.graph_break_count), (1, 0), explained.break_reasons)

    def test_fake_shapes(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            q = torch.empty(2, 8, 100, 128, dtype=torch.bfloat16, device="meta")
            k = torch.empty(2, 2, 300, 128, dtype=torch.bfloat16, device="meta")
            o, lse = torch.ops.sagebwd.attention_forward(q, k, k, True, "sagebwd", "", "", None)
            self.assertEqual((tuple(o.shape), o.dtype), ((2, 8, 100, 128), torch.bfloat16))
            self.assertEqual((tuple(lse.shape), lse.dtype), ((2, 8, 100), torch.float32))
            dq, dk, dv = torch.ops.sagebwd.attention_backward(o, q, k, k, o, lse)
            self.assertEqual([tuple(t.shape) for t in (dq, dk, dv)], [(2, 8, 100, 128), (2, 2, 300, 128)] + [(2, 2, 300, 128)])
            with self.assertRaisesRegex(ValueError, "unknown preset"):
                torch.ops.sagebwd.attention_forward(q, k, k, True, "int4", "", "", None)


if __name__ == "__main__":
    unittest.main()
