//! The `/v1/systemone` HTTP server.
//!
//! Not built yet: the server is a later issue. Nothing here answers requests.
