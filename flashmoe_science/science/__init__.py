"""Science workloads on the kernels: `tc`, superconductor Tc from composition (SuperCon).
Needs the `science` extra."""
