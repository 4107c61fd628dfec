//! Helpers of the crate's unit tests.

use candle_core::{DType, Tensor};

/// The largest `|a − b|` over all elements, computed in f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Every element's bits: f64 elements as they are, any other float dtype's through f32 (exact for
/// the dtypes the tests compare). Equal results mean bit-identical tensors of one dtype.
pub fn bits(t: &Tensor) -> Vec<u64> {
    let flat = t.flatten_all().unwrap();
    match flat.dtype() {
        DType::F64 => flat
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        _ => flat
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| u64::from(x.to_bits()))
            .collect(),
    }
}
