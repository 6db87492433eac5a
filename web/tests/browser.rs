#![cfg(target_arch = "wasm32")]
use wasm_bindgen_test::*;
use wgpu_attention::{Context, Path, Sdpa, Causal};
use ndarray::Array4;
wasm_bindgen_test_configure!(run_in_browser);

#[wasm_bindgen_test]
async fn spike() {
    let ctx = Context::new().await.unwrap();
    web_sys::console::log_1(&format!("{} {:?}", ctx.describe(), ctx.caps()).into());
    let q = Array4::<f32>::from_shape_fn((1, 2, 37, 20), |(a, b, c, d)| ((a + 3*b + 7*c + 11*d) % 13) as f32 / 13.0 - 0.5);
    let k = Array4::<f32>::from_shape_fn((1, 2, 41, 20), |(a, b, c, d)| ((a + 5*b + 3*c + 7*d) % 11) as f32 / 11.0 - 0.5);
    let v = k.clone();
    for path in Path::ALL {
        let out = Sdpa::new(&q, &k, &v).causal(Causal::BottomRight).path(path).run(&ctx).await.unwrap();
        let want = wgpu_attention::reference::sdpa(q.view(), k.view(), v.view(), &wgpu_attention::Options { causal: Causal::BottomRight, ..Default::default() }).unwrap();
        let r = wgpu_attention::check::compare(out.output.iter().copied(), want.out.iter().copied(), wgpu_attention::check::F32_TOLERANCE);
        web_sys::console::log_1(&format!("{path:?}: {r}").into());
        assert!(r.passed());
    }
}
