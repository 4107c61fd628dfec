//! GGUF reading, ggml block formats and GGUF writing.
