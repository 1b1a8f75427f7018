// Elementwise ops: one invocation per element of dst; src1 and src2 tile dst (ggml
// broadcasting). The entry points are generated from ops/elementwise.py's WGSL table (one
// expression per op, of a = src0, b = src1 and c = src2 at the element) into the one
// template there; here are the functions those expressions call.
// #include common

fn silu(x: f32) -> f32 { return x / (1.0 + exp(-x)); }

fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }

// log(1 + e^x) without overflow: max(x, 0) + log(1 + e^-|x|).
fn softplus(x: f32) -> f32 { return max(x, 0.0) + log(1.0 + exp(-abs(x))); }

// silu'(x) * dy.
fn silu_grad(x: f32, dy: f32) -> f32 {
    let s = 1.0 / (1.0 + exp(-x));
    return dy * s * (1.0 + x * (1.0 - s));
}

// gpt-oss's gate: g * sigmoid(alpha * g), g = min(x, limit) (swiglu_oai).
fn oai_gate(x: f32, alpha: f32, limit: f32) -> f32 {
    let g = min(x, limit);
    return g / (1.0 + exp(-alpha * g));
}

// oai_gate's derivative in x: 0 above the limit.
fn oai_gate_grad(x: f32, alpha: f32, limit: f32) -> f32 {
    let s = 1.0 / (1.0 + exp(-alpha * x));
    return select(0.0, s * (1.0 + alpha * x * (1.0 - s)), x <= limit);
}

const GELU_A: f32 = 0.044715;
const SQRT_2_OVER_PI: f32 = 0.7978845608028654;

// tanh of the gelu argument; clamped because tanh(u) overflows exp for large |u| on some
// drivers, and |u| > 10 is +-1 in f32 anyway.
fn gelu_tanh(x: f32) -> f32 {
    return tanh(clamp(SQRT_2_OVER_PI * x * (1.0 + GELU_A * x * x), -10.0, 10.0));
}

fn gelu(x: f32) -> f32 { return 0.5 * x * (1.0 + gelu_tanh(x)); }

// gelu'(x).
fn gelu_grad(x: f32) -> f32 {
    let t = gelu_tanh(x);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_A * x * x);
}

// #include elementwise_kernels
