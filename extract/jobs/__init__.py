"""The one sharded-job framework `extract run` and `extract generate` share: the
driver (`driver.run_sharded`), Ray start-up and the actor pool with its fenced
queue (`dispatch`), replacement actors until started (`starting`), batching, the
worker protocol (`protocol`: replies, failures,
fault injection), the settings both jobs take (`settings`), the output's lock
(`output`) and the target a worker holds (`target`, `kernels`)."""
