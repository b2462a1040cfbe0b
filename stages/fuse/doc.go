// Package fuse turns a step's rewards into what the trainer consumes: GRPO
// group advantages, the inverse-variance anchor weight rho (Denoiser), and
// per-trajectory fused advantages (Fuse) whose plain average over a step is
// the WMRL fused policy gradient. Corrector ties debiasing and denoising
// together in the order WMRL.md specifies.
//
// Everything here is pure: no I/O, no clocks, no hidden randomness.
package fuse
