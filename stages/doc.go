// Package stages holds one package per pipeline stage, each a pure core
// (math and state, deterministic, no I/O) and a thin message handler:
// route (anchor selection, step assembly), predict (world model), execute
// (anchors), pair (joins), calibrate (streaming isotonic refit) and fuse
// (rho, advantages, fused updates).
package stages
