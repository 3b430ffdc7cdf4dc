"""The controller process: owns all run state and drives the asynchronous pipeline."""
