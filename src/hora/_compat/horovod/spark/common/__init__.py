"""``horovod.spark.common`` on hora: only what ``horovod.spark.run`` uses (``util.host_hash``). The rest of Horovod's
package is the Estimators' (stores, backends, data preparation), which hora does not provide."""
