//! Host-side checks of the CUDA backend that need no GPU: what the kernels support, the size
//! estimate, and that opening a GPU on a machine without one is an error, not a panic.

use sagebwd::{Config, Error, Shape};
use sagebwd_cuda::{check_backward_supported, check_supported, device_bytes, Gpu};

#[test]
fn unsupported_head_dims_and_block_sizes_are_clear_errors() {
    let cfg = Config::sagebwd();
    assert!(check_supported(&Shape::square(1, 2, 100, 64), &cfg).is_ok());
    assert!(check_supported(&Shape::square(1, 2, 100, 128), &cfg).is_ok());
    for d in [32, 96, 256] {
        let e = check_supported(&Shape::square(1, 2, 100, d), &cfg).unwrap_err();
        assert!(matches!(e, Error::HeadDim { got, .. } if got == d), "{e}");
    }
    let mut small = cfg.clone();
    small.block_kv = 64;
    assert!(matches!(
        check_supported(&Shape::square(1, 2, 100, 64), &small),
        Err(Error::Config(_))
    ));
    let e = check_supported(&Shape::square(1, 70_000, 16, 64), &cfg).unwrap_err();
    assert!(matches!(e, Error::Shape(ref m) if m.contains("65535")), "{e}");
}

#[test]
fn simulated_only_variants_are_refused_by_name() {
    let s = Shape::square(1, 2, 128, 128);
    let mut fp8_forward = 0;
    for name in sagebwd::config::VARIANTS {
        let cfg = Config::preset(name).unwrap();
        if cfg.has_fp8_forward_kernel() {
            // The FP8 P·V forward runs (sm_90a); the backward is refused by name.
            fp8_forward += 1;
            assert!(check_supported(&s, &cfg).is_ok(), "{name}");
            let e = check_backward_supported(&cfg).unwrap_err();
            assert!(
                matches!(e, Error::Config(ref m) if m.contains("forward only")),
                "{name}: {e}"
            );
            continue;
        }
        let e = check_supported(&s, &cfg).unwrap_err();
        assert!(
            matches!(e, Error::Config(ref m) if m.contains("simulated only")),
            "{name}: {e}"
        );
    }
    // p-e4m3, p-e4m3-ds-axis, p-e4m3-ds-e4m3, p-e4m3-ds-e5m2 (not fp8-tensor: per-tensor V; not the δ-from-O′ ones).
    assert_eq!(fp8_forward, 4);
    assert!(check_backward_supported(&Config::sagebwd()).is_ok());
}

#[test]
fn device_memory_estimate_covers_the_inputs_and_grows_with_the_problem() {
    let s = Shape::square(2, 4, 1000, 128);
    let inputs_bf16 = 2 * (s.q_len() + 2 * s.kv_len());
    let fwd = device_bytes(&s, false);
    let both = device_bytes(&s, true);
    assert!(fwd > inputs_bf16 && both > fwd, "{inputs_bf16} {fwd} {both}");
    // The backward keeps FP32 dK, dV per query head and an FP32 dQ: at least 12 bytes per element.
    assert!(both - fwd >= 12 * s.q_len());
    assert!(device_bytes(&Shape::square(2, 4, 2000, 128), true) > both);
}

#[test]
fn opening_a_gpu_never_panics() {
    // On CI (no driver) this is an error naming the missing library; on a GPU machine it opens.
    match Gpu::new() {
        Ok(g) => println!("GPU present: {}", g.describe()),
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, Error::Backend(_)), "{msg}");
            assert!(
                msg.contains("not found") || msg.contains("GPU") || msg.contains("CUDA"),
                "{msg}"
            );
            println!("no GPU here: {msg}");
        }
    }
}
