// Package calibrate learns the world model's bias from anchor pairs
// (world-model score, true score) and removes it: a weighted isotonic
// regression with scikit-learn semantics (FitIsotonic) and an online
// debiaser that refits it on a bounded buffer as pairs stream in (Debiaser).
//
// Everything here is pure: no I/O, no clocks, no hidden randomness.
package calibrate
