"""The controller's side of where models run (runs in the controller, the caller's
process): the ``Executor`` protocol and what it hands back (``interface``), models run in
this process (``inprocess``) or in worker processes (``pool_executor`` over the pool of
``pool``: its workers and their replacement in ``workers``, the controller's end of each
worker process in ``handle``, call deadlines in ``deadline``, the records of training
segments on the jobs' home workers in ``segments``), and a registered model built and
packed into host stores for them (``packing``). Never imports the controller's core (``runtime``); what
runs inside a worker process is ``timeshare.worker``.
"""
