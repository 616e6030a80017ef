"""Native CPU kernels: C++ sources built on first use into cached shared libraries whose XLA FFI
targets are registered with JAX (`build.NativeLibrary`); each module here wraps one library."""
