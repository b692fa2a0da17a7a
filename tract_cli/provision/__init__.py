"""Provisioning and platform checks: the ndctl-project tools (cxl, ndctl,
daxctl), sysfs readers, NUMA and CPU placement, `tract doctor`."""
