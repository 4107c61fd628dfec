//! GGUF metadata values.

use crate::error::{GgufError, Result};

/// The value-type ids of GGUF metadata (`gguf_type`): a table of GGUF's numbers, alike line by line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetadataType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl MetadataType {
    /// Every type, in id order.
    pub const ALL: [MetadataType; 13] = {
        use MetadataType::*;
        [
            U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64,
        ]
    };

    /// The type with id `v`, if GGUF defines one.
    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_u32() == v)
    }

    pub fn as_u32(self) -> u32 {
        self as u32
    }

    /// Size in the file of one value of a fixed-size type; `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<usize> {
        use MetadataType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The fewest bytes one value of this type can take in a file (a string is at least its u64 length,
    /// an array at least its element type and count). Used to refuse counts before allocating.
    pub fn min_size(self) -> usize {
        match self {
            MetadataType::String => 8,
            MetadataType::Array => 12,
            other => other.fixed_size().unwrap_or(1),
        }
    }

    pub fn name(self) -> &'static str {
        use MetadataType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value. Arrays hold their elements as values; a GGUF array is homogeneous, which the
/// reader guarantees and the writer checks.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetadataValue {
    pub fn value_type(&self) -> MetadataType {
        match self {
            MetadataValue::U8(_) => MetadataType::U8,
            MetadataValue::I8(_) => MetadataType::I8,
            MetadataValue::U16(_) => MetadataType::U16,
            MetadataValue::I16(_) => MetadataType::I16,
            MetadataValue::U32(_) => MetadataType::U32,
            MetadataValue::I32(_) => MetadataType::I32,
            MetadataValue::F32(_) => MetadataType::F32,
            MetadataValue::Bool(_) => MetadataType::Bool,
            MetadataValue::String(_) => MetadataType::String,
            MetadataValue::Array(_) => MetadataType::Array,
            MetadataValue::U64(_) => MetadataType::U64,
            MetadataValue::I64(_) => MetadataType::I64,
            MetadataValue::F64(_) => MetadataType::F64,
        }
    }

    /// Any integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetadataValue::U8(v) => Some(v.into()),
            MetadataValue::U16(v) => Some(v.into()),
            MetadataValue::U32(v) => Some(v.into()),
            MetadataValue::U64(v) => Some(v),
            MetadataValue::I8(v) => u64::try_from(v).ok(),
            MetadataValue::I16(v) => u64::try_from(v).ok(),
            MetadataValue::I32(v) => u64::try_from(v).ok(),
            MetadataValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type whose value fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetadataValue::U8(v) => Some(v.into()),
            MetadataValue::U16(v) => Some(v.into()),
            MetadataValue::U32(v) => Some(v.into()),
            MetadataValue::U64(v) => i64::try_from(v).ok(),
            MetadataValue::I8(v) => Some(v.into()),
            MetadataValue::I16(v) => Some(v.into()),
            MetadataValue::I32(v) => Some(v.into()),
            MetadataValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// F32 (widened exactly) or F64. Integers are not converted: GGUF writers store real-valued
    /// hyper-parameters as floats, and a float key holding an integer is more likely a wrong key.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(v) => Some(v.into()),
            MetadataValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetadataValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// `"u8"`, `"string"`, `"array"`, …
    pub fn type_name(&self) -> &'static str {
        self.value_type().name()
    }

    /// For arrays: the element type name (`"array[u32]"`); for others the same as [`Self::type_name`].
    pub fn full_type_name(&self) -> String {
        match self {
            MetadataValue::Array(items) => match items.first() {
                Some(first) => format!("array[{}]", first.full_type_name()),
                None => "array[]".to_string(),
            },
            other => other.type_name().to_string(),
        }
    }
}

/// Lookups with errors that name the key.
pub(crate) fn typed<'a, T>(
    key: &str,
    value: Option<&'a MetadataValue>,
    expected: &'static str,
    convert: impl FnOnce(&'a MetadataValue) -> Option<T>,
) -> Result<T> {
    let value = value.ok_or_else(|| GgufError::MissingKey {
        key: key.to_string(),
    })?;
    convert(value).ok_or_else(|| GgufError::WrongType {
        key: key.to_string(),
        expected,
        found: value.type_name(),
    })
}

#[cfg(test)]
mod tests {
    use super::MetadataType;

    #[test]
    fn every_type_id_maps_back_to_its_type() {
        for (id, ty) in MetadataType::ALL.into_iter().enumerate() {
            assert_eq!(ty.as_u32(), id as u32);
            assert_eq!(MetadataType::from_u32(id as u32), Some(ty));
        }
        assert_eq!(MetadataType::from_u32(13), None);
    }
}
