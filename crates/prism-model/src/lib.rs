//! The Qwen3.5 hybrid decoder on candle.
