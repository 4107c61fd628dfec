//! StartLux-Decision: requests, prompt rendering, read-out and calibrated probabilities.
