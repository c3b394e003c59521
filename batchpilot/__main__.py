from batchpilot.cli import main

raise SystemExit(main())
