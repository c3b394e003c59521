module batchpilot.local/runc-capfix

go 1.25.0
